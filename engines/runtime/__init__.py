"""What every local engine shares: loading a model, sampling, and turning tokens into text
that is safe to stream. Import from the modules (loader, sampling, detokenizer, tiny_model)."""
