"""Preference learning over the one train step: programmatic rewards (``rewards``), a batched
n-per-prompt sampler on the inference engine (``sampler``), on-/off-policy pairs and SimpleMix
(``pairs``), the toy objective / open-ended families (``tasks``) and the ``preference`` data kind
(``data``) that feeds the ``dpo`` loss."""
