"""vLLM general plugin: registers ``LMKVConnector`` by name once lmkv is installed.

With it, ``--kv-transfer-config '{"kv_connector": "LMKVConnector", "kv_role": "kv_both"}'``
works without ``kv_connector_module_path``. vLLM loads general plugins in every
process it starts (the entry point is declared in lmkv's ``pyproject.toml``), so
registering twice must be harmless.
"""

from __future__ import annotations

NAME = "LMKVConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "lmkv.connectors.vllm", "LMKVConnector")
