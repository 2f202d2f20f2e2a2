"""Sequences, paged KV block manager, continuous-batching scheduler, model runner, sampler."""
