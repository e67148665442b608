"""Functional layers of the Qwen3.5 text model: pure functions of (params, config, inputs, carry)."""
