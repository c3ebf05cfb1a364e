from ._stub import define

STUBBED = ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8")
define(globals(), __name__, STUBBED)
