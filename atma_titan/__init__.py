"""atma_titan: distributed pretraining for the ATMA hybrid language model."""
