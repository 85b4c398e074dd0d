"""The target service: holds the target model and verifies drafted tokens."""
