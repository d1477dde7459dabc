"""Every name that crosses a process boundary, defined once: environment variables, the reward model's Triton
names, probe paths, component names and the labels that Prometheus and Kubernetes select on.

Two kinds of label must not be confused: `PROMETHEUS_*_LABEL` are the labels of scraped series (what the
dashboards and alerts select on), `K8S_*_LABEL` are the labels of the run's Kubernetes objects (what the
operator's selectors match).
"""

# --- environment variables (secrets travel in the environment, never on a command line) ---------------------
REDIS_URL_ENV = "REINFORCE_REDIS_URL"
# One credential per capability (launch.py says which service holds which). The generators' control plane: they
# check it, the weight reconciler sends it. The trainer's weight endpoint: it checks it, generators send it. The
# critic's API: it checks it, the trainer alone sends it.
CONTROL_TOKEN_ENV = "REINFORCE_CONTROL_TOKEN"
WEIGHTS_TOKEN_ENV = "REINFORCE_WEIGHTS_TOKEN"
CRITIC_TOKEN_ENV = "REINFORCE_CRITIC_TOKEN"
OPERATOR_CONFIG_ENV = "REINFORCE_OPERATOR_CONFIG"  # path of the operator's configuration file
POD_NAME_ENV = "POD_NAME"  # the pod's own name, from the downward API (a StatefulSet ordinal ends it)

# --- bind addresses: a local run listens on loopback only; pods bind every interface (--host, see launch.py) -----
LOCAL_HOST = "127.0.0.1"
ANY_HOST = "0.0.0.0"

# --- components: process names locally, pod components on Kubernetes, `component` label in Prometheus --------
COMPONENT_REDIS = "redis"
COMPONENT_REWARD = "reward"
COMPONENT_GENERATOR = "generator"
COMPONENT_TRAINER = "trainer"
COMPONENT_CRITIC = "critic"  # PPO only (algorithm.name ppo)
# environment.enabled only: the environment service (tools for multi-turn rollouts)
COMPONENT_ENVIRONMENT = "environment"
COMPONENTS = (
    COMPONENT_REDIS, COMPONENT_REWARD, COMPONENT_GENERATOR, COMPONENT_TRAINER, COMPONENT_CRITIC, COMPONENT_ENVIRONMENT,
)  # fmt: skip

CRITIC_PORT = 5556  # the critic service's default port (NeMo-Aligner's)
ENVIRONMENT_PORT = 5557  # the environment service's default port
# The Tinker training API (`reinforce serve`): its clients send the key in X-API-Key; the SDK refuses any key that
# does not begin with TRAINING_API_KEY_PREFIX before it sends anything.
COMPONENT_TRAINING_API = "training-api"
TRAINING_API_PORT = 5558
TRAINING_API_KEY_ENV = "REINFORCE_TRAINING_API_KEY"
TRAINING_API_KEY_PREFIX = "tml-"
# A training-API session silent this long expires (its models saved and unloaded); the SDK beats every 10 s.
TRAINING_API_SESSION_TIMEOUT_S = 600.0
# its API: it checks it, generators send it, and the reward server when it runs code there (reward.function code_tests)
ENVIRONMENT_TOKEN_ENV = "REINFORCE_ENVIRONMENT_TOKEN"

# --- the reward model on Triton -------------------------------------------------------------------------------
REWARD_MODEL = "reward"
REWARD_INPUT_PROMPT = "prompt"
REWARD_INPUT_RESPONSE = "response"
# Optional: the prompt's reference answer ("" for none); this project's client always sends it.
REWARD_INPUT_ANSWER = "answer"
REWARD_OUTPUT = "reward"
# The server prefixes the error of a failing reward function with this, so that clients do not retry it.
REWARD_FN_FAILED = "reward function failed"

# --- probes ---------------------------------------------------------------------------------------------------
# Served by the generator, the critic and the environment service (core/http_kit.py's add_probes): their pods'
# liveness and readiness probes. READY_PATH is also what `reinforce run` polls until those children are ready, and
# the trainer's critic client until the critic is. (The operator's own liveness endpoint is kopf's, at the URL its
# --liveness flag names; the reward server's probes are Triton's, below.)
HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
METRICS_PATH = "/metrics"
# The model's readiness, not the server's: Triton's /v2/health/ready answers 200 before the model has loaded.
REWARD_READY_PATH = f"/v2/models/{REWARD_MODEL}/ready"
REWARD_LIVE_PATH = "/v2/health/live"

# --- labels ---------------------------------------------------------------------------------------------------
PROMETHEUS_RUN_LABEL = "run"
PROMETHEUS_COMPONENT_LABEL = "component"
PROMETHEUS_INSTANCE_LABEL = "instance"
# The environment service's `tool` label of calls that did not parse or named no tool (counted as errors, not calls)
INVALID_TOOL = "invalid"
K8S_NAME_LABEL = "app.kubernetes.io/name"  # "reinforce" on a run's objects, OPERATOR_APP_NAME on the operator's
K8S_INSTANCE_LABEL = "app.kubernetes.io/instance"  # the run's name
K8S_COMPONENT_LABEL = "app.kubernetes.io/component"
OPERATOR_APP_NAME = "reinforce-operator"  # the operator's K8S_NAME_LABEL (chart and operator/operator.yaml)
