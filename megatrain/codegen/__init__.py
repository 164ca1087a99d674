"""megatrain.codegen: render a Plan's Program as a readable Python step program, and load it."""

from .emit import CodegenError, emit, load

__all__ = ["CodegenError", "emit", "load"]
