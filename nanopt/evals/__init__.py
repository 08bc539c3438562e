"""Evaluation beyond val loss: the decode loop, the continuation scorer, CORE, lm-eval tasks."""
