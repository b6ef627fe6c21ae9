"""The model and how it is split into pipeline stages, the data, and the reference trainer."""
