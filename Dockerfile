# apportion: one image per service, chosen by the build argument SERVICE (accounting, dispatcher, node_agent,
# policy, web). Build from the repository root:
#   docker build --build-arg SERVICE=dispatcher -t apportion-dispatcher .
#   docker build --build-arg SERVICE=node_agent --build-arg RUN_AS=root -t apportion-node-agent .
# RUN_AS is the account the service runs as. Every service but the node agent runs as the unprivileged
# `apportion`, with a writable home and working directory (faust's data directory, matplotlib's font cache).
# The node agent runs as root: it starts each command as the Unix account of the job's user, in a cgroup of its
# own (docs/security.md, "Node boundary"), and refuses to start commands when it cannot; its container needs the
# host's cgroup hierarchy writable and the NVIDIA device files (a real node's deployment).
FROM python:3.11-slim
ARG SERVICE
ARG RUN_AS=apportion
RUN case "$SERVICE" in accounting|dispatcher|node_agent|policy|web) ;; \
      *) echo "build argument SERVICE must be one of accounting, dispatcher, node_agent, policy, web" >&2; exit 1;; \
    esac
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . \
 && useradd --system --create-home --home-dir /var/lib/apportion apportion
USER ${RUN_AS}
WORKDIR /var/lib/apportion
# the parent of the policy's per-instance faust data directory (the other services do not read it)
ENV APPORTION_FAUST_DIR=/var/lib/apportion SERVICE_MODULE=services.${SERVICE}
# exec: the service is PID 1 and gets the container's SIGTERM itself
CMD ["sh", "-c", "exec python -m \"$SERVICE_MODULE\""]
