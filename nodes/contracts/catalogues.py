"""Names both sides know: campaign files are validated against them on the controller, and the nodes
look their models up by them. Each registry on the node side holds these names (a test checks), so a
name is added here and in its registry, nowhere else.
"""

SCHEDULER_NAMES = ("fcfs", "rr", "andes", "andes-dp")  # a campaign's serving.scheduler (nodes.serving.schedulers)
ENGINE_SCHEDULER_NAMES = SCHEDULER_NAMES + ("static",)  # and static batching, which a method's batching sets
DISPATCH_POLICIES = ("server-only", "device-only", "stoch-s", "stoch-d", "disco-s", "disco-d")  # nodes.dispatch
SERVICE_NAMES = ("gpt", "deepseek", "command", "llama")  # the services DiSCo traced (nodes.endpoints.services)
DEVICE_SPEED_NAMES = ("pixel7pro-bloom-1.1b", "pixel7pro-bloom-560m", "xiaomi14-qwen-0.5b")  # .device_speed
