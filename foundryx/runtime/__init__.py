"""The ground floor: what a foundryx process needs before any part of the product runs, one job
per module: logging set-up (``log_setup``), third-party warnings (``known_warnings``), the device
and what it can do (``device_choice``, ``devices``), process groups (``process_groups``), the
preemption signals (``preempt``), host memory (``host_heap``), file modes and all-or-nothing
writes (``file_modes``, ``atomic_writes``), the installed stack and its version differences
(``stack``, ``hf_compat``), the Hugging Face hub (``hub``) and the run's closing summary
(``run_summary``). It imports nothing of foundryx but ``errors`` and ``registry``; every part
above may import it."""
