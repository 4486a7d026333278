"""Policy training: update backends, cold-start SFT, exact checkpoints and resumable data order."""
