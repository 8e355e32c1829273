"""The KServe v2 gateway: Envoy on the hot path (``envoy``), the Python activator on the cold path (``activator``)."""
