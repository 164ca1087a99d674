"""megatrain.codegen: render a Plan's Program as a readable Python step program, and load it."""

from .emit import CodegenError, emit, live_bytes, load

__all__ = ["CodegenError", "emit", "live_bytes", "load"]
