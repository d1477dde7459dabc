"""The Kubernetes operator (`reinforce operator`, kopf): runs each ReinforceRun custom resource as the pods of its
services."""
