"""Messages between processes (msgspec Structs). Imports nothing from the package except the
leaf `sampling_params` module, whose Struct travels inside requests."""
