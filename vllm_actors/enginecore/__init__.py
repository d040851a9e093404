"""The engine core: request state, scheduling, KV block accounting. Pure Python, no device."""
