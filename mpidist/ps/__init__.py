"""Parameter server over MPI one-sided communication: BSP, ASP and SSP(s) consistency.

See docs/ARCHITECTURE.md (parameter server).
"""
from mpidist.ps.consistency import Consistency, StalenessRecord, Straggler, format_histogram
from mpidist.ps.server import ParameterServer, place_servers
from mpidist.ps.shard import ServerStats, ShardServer, SumUpdate
from mpidist.ps.worker import Worker

__all__ = ["ParameterServer", "ShardServer", "ServerStats", "SumUpdate", "Worker",
           "Consistency", "Straggler", "StalenessRecord", "format_histogram", "place_servers"]
