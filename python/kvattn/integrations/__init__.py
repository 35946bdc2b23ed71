"""Optional integrations of kvattn with other frameworks. Each submodule
imports its framework on import; `import kvattn` imports none of them.

  kvattn.integrations.transformers: an AttentionInterface function "kvattn"
    and KvattnQuantizedCache (K/V kept MLX-packed, 4 or 8 bits).
"""
