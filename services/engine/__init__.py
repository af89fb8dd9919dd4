"""The built-in generation engine, its own deployable (`sluice engine`): SGLang's HTTP protocol over a
batched decoder with a shared KV pool (docs/engine.md)."""
