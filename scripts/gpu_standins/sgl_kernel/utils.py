from .ops import is_arch_support_pdl  # noqa: F401
