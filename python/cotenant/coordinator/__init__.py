"""The per-node coordinator: daemon, protocol, policies and the job-side client."""

from cotenant.coordinator.client import (  # noqa: F401
    AdmissionRefused,
    CoordinatorError,
    CoordinatorUnavailable,
    Registration,
    UntrustedCoordinator,
    register,
    send_command,
    set_cap,
    set_share,
    status,
)
from cotenant.coordinator.paths import default_socket_path  # noqa: F401
