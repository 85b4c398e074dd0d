"""The orchestrator: Tandem's public face. It owns sessions and committed tokens
(in Redis), runs draft→verify rounds and streams tokens to clients."""
