"""`evolving chaos`: the fault suite over a live stack."""
