"""The five SmartGen services. Each folder has the same shape:
__main__.py (config → run), config.py, service.py (NATS handlers), engine.py or state.py, admin routes.
"""
