"""Deployment manifests generated from a model folder: ``serving k8s`` (the command: ``serving.deploy.k8s``).

The modules: ``manifests`` (names, labels and the list of documents), ``model`` (what a model folder says about
its weights and layout), ``resources`` (how much CPU, memory and GPU a pod asks for, from the model's configuration
and the engine's memory preflight, and how long it may take to start), ``pods`` (the container and pod template),
``monitoring`` (Service, HorizontalPodAutoscaler, prometheus-adapter rule, ServiceMonitor), ``kserve``
(ServingRuntime, InferenceService) and ``lws`` (LeaderWorkerSet for a model split over several hosts).
"""

DEFAULT_CPUS = 4  # the cores a pod gets where the model's workers or threads are auto (``serving k8s --cpus``)
