"""Speed code, each piece behind one switch with a plain twin and an equivalence test: fused LoRA layers
(``lora``, switch ``base.fused_lora``), the fused log-prob head and its chunked dispatcher (``lm_head``, chosen per
model by whether its logits come from a plain linear head), the inverse-CDF sampler (``sampling``) and the fused
tanh-GELU (``activations``, switch ``base.fused_activations``). Nothing here imports the modules above it."""
