"""The only code that touches transformers internals."""
