"""The draft service: proposes the next tokens of a session."""
