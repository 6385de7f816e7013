from dataclasses import dataclass

from shared.runtime.config import ConfigError, ServiceConfig


@dataclass(slots=True)
class KvProfileConfig(ServiceConfig):
    bucket: str = ""  # JetStream key-value bucket holding the profiles; "" = smartgen_profiles (per namespace)
    bucket_replicas: int = 1  # copies of the bucket across a JetStream cluster (3 on a 3-node cluster)
    online_weight: float = 0.05  # each served request moves a profile at most this far toward what it selected
    online_updates: bool = True  # refresh profiles from served requests (POST /online switches it at run time)
    model: str = ""  # the model calibration runs on (loaded on the first build); "" = the cached default SmolLM2
    device: str = "cpu"  # where calibration runs: "cpu", "cuda", "cuda:1", …
    dtype: str = "auto"  # calibration's compute dtype: "auto" = float32 on CPU, bfloat16 on CUDA
    torch_threads: int = 0  # 0 = torch's default
    page_tokens: int = 16  # tokens per KV page, as the decode workers page KV
    kv_dtype: str = "bfloat16"  # as the decode workers keep KV (shared/runtime/config.py ModelWorkerConfig.kv_dtype)

    def validate(self) -> None:
        ServiceConfig.validate(self)
        if not 0 < self.online_weight <= 1:
            raise ConfigError("online_weight must be in (0, 1]")
        if self.kv_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ConfigError(f"kv_dtype {self.kv_dtype!r}: use float32, bfloat16, float16, or '' for the compute dtype")
        if not self.bucket:
            self.bucket = f"smartgen_{self.namespace}_profiles" if self.namespace else "smartgen_profiles"
        if not self.bucket.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"bucket {self.bucket!r}: use letters, digits, '-' and '_'")
        if not 1 <= self.bucket_replicas <= 5:
            raise ConfigError("bucket_replicas must be 1 to 5 (JetStream's limit), and at most the cluster's servers")
