"""What is saved: sharded checkpoints, their staging on disk, and untrusted reading."""
