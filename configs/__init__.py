"""Experiment files (data): one Python file per experiment defining ``get_config(arg=None)``.

They build on ``pallasite.training.config`` (the schema ``train_defaults``, ``parse_arg``,
``load_config`` with ``--config.a.b=v`` overrides) and the model presets in ``configs/models.py``.
"""
