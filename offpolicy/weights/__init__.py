"""What the learner and the actors must agree on: the policy record, the manifest, transfer control and
membership, the transfer settings, and the engine pairs registered in vLLM."""
