"""The five SmartGen services. Each folder has the same shape: __main__.py (config → run), config.py,
service.py (NATS handlers, opening with the request's life cycle), and the service's own logic beside it
(the broker's planner.py and plans.py, kvprofile's engine.py and store.py, decode's request.py and remote.py).
Torch work lives in shared/compute/; no service imports another.
"""
