"""The SSH host agent: one per remote host of a job, under one SSH channel (``--launcher ssh``).

* ``main.py``: the agent itself (``python -m hvdrun.launch.remote.host_agent.main``): answers with its host's
  facts, runs the host's ranks and relays for the hosts beneath it in the tree;
* ``local_ranks.py``: the ranks of its host, each guard forked with its own lifeline;
* ``channel.py``: an agent seen from above (from hvdrun, or from the agent of the host above it);
* ``messages.py``: what hvdrun and the agents say to each other (frames down, tagged lines up).

hvdrun's end of the agents, the tree they form, is :mod:`hvdrun.launch.agent_forest`. Standard library only.
"""
