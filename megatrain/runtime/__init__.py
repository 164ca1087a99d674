"""megatrain.runtime."""
