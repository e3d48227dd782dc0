"""Sandboxed execution of generated code (``sandbox``) and the HumanEval harness (``humaneval``)."""
