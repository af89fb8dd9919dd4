"""The SGLang HTTP protocol as a client (`SGLangClient`): the rollout generates with it, the weight
publisher drives engine weight updates with it. It talks to a real SGLang server and to the built-in
engine (`services/engine`) alike."""
