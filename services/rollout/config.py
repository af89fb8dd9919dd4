from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.dcs.models import engine_url
from services.run_contract.judge_settings import JUDGE_NAME
from services.role.role_service import RoleSettings


class RolloutConfig(RoleSettings):
    """`sluice rollout`: takes prompts, generates n_samples_per_prompt responses per prompt through the
    engines (built-in or SGLang; requests balanced across them), scores them and writes whole groups
    to TransferQueue partition train_<step>, admitting new groups continuously up to the run's
    staleness bound. What to generate (prompts, reward, sampling) is the run's config on the coordinator."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_ROLLOUT_")

    engine_url: str = Field(
        "http://127.0.0.1:30000",
        description="comma-separated engine base URLs (SGLang protocol) "
        "to start with; the run's engine set on the coordinator is followed from then on (engines "
        "added with `sluice engines add` or registering themselves join, removed ones leave); "
        "may be empty",
    )
    engine_poll_s: float = Field(
        1.0, gt=0, le=60, description="how often the run's engine set is read from the coordinator"
    )
    reward_token: str = Field(
        "",
        description="bearer token for a remote HTTP reward endpoint (never the "
        "stack's auth token: the endpoint may be a third party)",
    )
    judge_urls: str = Field(
        "",
        description="judge engines by name, for rollout.reward model:<name>: comma-"
        "separated name=URL (`sluice run` gives judge=<its judge engine>); a judge is never "
        "one of the run's engines: the trainer does not update its weights",
    )
    register_engines: bool = Field(
        True,
        description="add the --engine-url engines to the run's engine set and "
        "keep them registered (so the trainer updates their weights); off when they "
        "register themselves",
    )
    port: int = Field(7500, ge=0, le=65535, description="port of /healthz /readyz /status /metrics")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of one generate request")
    version_poll_s: float = Field(
        0.05,
        gt=0,
        description="how often the weight version of an engine without a "
        "long poll (SGLang) is read (a new version admits the next groups at once)",
    )
    version_wait_s: float = Field(
        5.0,
        gt=0,
        le=60,
        description="how long one long poll of the built-in engine's weight version may wait for it to move",
    )
    put_linger_s: float = Field(
        0.05,
        ge=0,
        le=10,
        description="how long a finished group's write may wait for "
        "the groups of its step still generating, so that they share one put (0 = never)",
    )
    lost_check_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="how often to look for rows lost with a storage "
        "shard before the trainer consumed them (their groups are generated again)",
    )

    @field_validator("engine_url")
    @classmethod
    def _engine_urls(cls, value: str) -> str:
        for url in value.split(","):
            if url.strip():
                engine_url(url)  # ValueError naming the URL and what is wrong with it
        return value

    @field_validator("judge_urls")
    @classmethod
    def _judge_urls(cls, value: str) -> str:
        for entry in filter(str.strip, value.split(",")):
            name, sep, url = entry.partition("=")
            if not sep or not JUDGE_NAME.fullmatch(name.strip()):
                raise ValueError(
                    f"judge_urls entry {entry.strip()!r} must be name=URL (a name of letters, digits, _ . -)"
                )
            engine_url(url.strip())  # ValueError naming the URL and what is wrong with it
        return value

    @property
    def judge_url_map(self) -> dict[str, str]:
        pairs = (entry.partition("=") for entry in self.judge_urls.split(",") if entry.strip())
        return {name.strip(): engine_url(url.strip()) for name, _, url in pairs}

    @property
    def engine_urls(self) -> list[str]:
        """In the coordinator's form (scheme://host:port), so a listed engine is the same one its engine set holds."""
        return [engine_url(u) for u in self.engine_url.split(",") if u.strip()]
