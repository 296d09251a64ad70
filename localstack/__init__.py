"""resilientjob.localstack: a Kubernetes control plane on one machine, for `rjob local` and `rjob demo`.

The emulated API server over real HTTP (`emulator.LocalApiServer` on kmock, answering as kube-apiserver
where outcomes depend on it: `_local_api_*`), a process kubelet (`kubelet.ProcessKubelet`) and the
supervisor that runs them with a real redis-server and the real operator process (`stack.serve`; `python -m
resilientjob.localstack <state dir>`). It needs the `local` extra (`pip install 'resilientjob[local]'`: kmock,
cel-python); nothing else in the product imports it. It uses the operator's public modules only (`crd`,
`kube`, `names`), never the agent.
"""
