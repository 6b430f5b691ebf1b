"""GGML quant formats: the type registry and vectorized torch dequantizers (CPU and CUDA alike)."""

from pocketmoe.quant import floats, iquants, kquants, legacy, mx, ternary  # noqa: F401  (they register)
from pocketmoe.quant.formats import (
    FORMATS,
    GGMLType,
    QuantError,
    QuantFormat,
    dequantize,
    format_of,
    type_name,
)

__all__ = ["FORMATS", "GGMLType", "QuantError", "QuantFormat", "dequantize", "format_of", "type_name"]
