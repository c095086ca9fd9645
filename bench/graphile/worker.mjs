// A graphile-worker worker for bench/compare.py (bench/peers.py starts it as the "graphile-worker"
// system): `node worker.mjs <connection string> <concurrency>`, on the Node 22 that package.json pins. It serves the two workloads of
// the harness, "noop" (returns at once) and "sleep" (waits one second), prints "ready" once it
// is running and stops cleanly on SIGTERM.
//
// Settings: the throughput configuration of graphile-worker's own performance page
// (worker.graphile.org/docs/performance): batched fetch through a local queue of 500 jobs and
// batched completion and failure (completeJobBatchDelay / failJobBatchDelay 0), with the
// harness's concurrency (the same for every system) and a pool of one connection more than
// that, at most 25, as the page has (concurrentJobs 24, maxPoolSize 25).
import { run } from "graphile-worker";

const [connectionString, concurrencyArg] = process.argv.slice(2);
const concurrentJobs = Number(concurrencyArg);
if (!connectionString || !Number.isInteger(concurrentJobs) || concurrentJobs < 1) {
  console.error("usage: node worker.mjs <connection string> <concurrency>");
  process.exit(2);
}

const quiet = () => () => {};
const runner = await run({
  noHandleSignals: true,
  taskList: {
    noop: async () => {},
    sleep: () => new Promise((resolve) => setTimeout(resolve, 1000)),
  },
  logger: new (await import("graphile-worker")).Logger(quiet),
  preset: {
    worker: {
      connectionString,
      concurrentJobs,
      maxPoolSize: Math.min(concurrentJobs + 1, 25),
      pollInterval: 1000,
      localQueue: { size: 500 },
      completeJobBatchDelay: 0,
      failJobBatchDelay: 0,
    },
  },
});
console.log("ready");

let stopping = false;
process.on("SIGTERM", () => {
  if (stopping) return;
  stopping = true;
  runner.stop().then(
    () => process.exit(0),
    (error) => {
      console.error(error);
      process.exit(1);
    },
  );
});
await runner.promise;
