"""Post-training recipes over the one train step: chat/SFT data (``chat``, ``sft_data``), the model
a recipe starts from (``model_init``: a pretrained model, LoRA, partial freezing), code-first CoT
(``code_cot``) and the synthetic-facts editing benchmark (``editing``)."""
