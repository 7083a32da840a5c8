"""The actor's side of the weights: following the policy record, files (verify, prefetch), transfer groups."""
