"""What a rollout worker runs: the gates, their flows, probes, scripts and step metrics."""
