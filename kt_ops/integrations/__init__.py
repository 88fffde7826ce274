"""Integrations of kt_ops with training frameworks (LLaMA-Factory: :mod:`.llamafactory`)."""
