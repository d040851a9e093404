"""The frontend: user-facing APIs, tokenization, detokenization. Never touches a device."""
