"""megatrain.ir."""
