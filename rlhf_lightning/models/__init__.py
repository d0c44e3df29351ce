"""The one frozen base and its roles, knowing nothing of data or training: the shared base seen through named LoRA
adapters (``shared_base``), its adapters on disk (``adapter_files``), whether a saved adapter fits a base
(``adapter_fit``) and the fingerprint of the weights it was trained on (``fingerprint``), the scalar heads
(``heads``), the specs of a base and of LoRA adapters (``spec``), loading tokenizers and models (``loading``), the
model's own logit post-processing (``logits``), log-probs of any role (``logprobs``), an adapter merged into the
base's weights (``merging``), a group's prompt encoded once (``shared_prompt``), FSDP2 sharding
(``sharding``) and the FLOPs its passes run (``flop_counter``)."""
