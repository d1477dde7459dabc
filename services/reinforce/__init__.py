"""reinforce: a Kubernetes-native REINFORCE (RLOO) RLHF pipeline."""
