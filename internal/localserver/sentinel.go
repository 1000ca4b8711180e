package localserver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// MasterName is the name the Sentinels of StartSentinels monitor their master under.
const MasterName = "idemq"

// Sentinels is a Redis master, one replica of it and three Sentinels that monitor it
// (quorum 2, down after 1 s), each a private server on a free loopback port.
type Sentinels struct {
	Master, Replica *Redis
	Sentinels       []*Server
	// URL names the master through the Sentinels, in go-redis's failover form
	// (redis://s1/0?master_name=idemq&addr=s2&addr=s3).
	URL string
	// Addrs are the Sentinels' host:port.
	Addrs []string
}

// StartSentinels starts the master, the replica (and waits until it is in sync), then the
// Sentinels, and waits until each of them knows the replica and the other two: from then
// on, a master that dies is replaced by the replica within a few seconds.
func StartSentinels() (_ *Sentinels, err error) {
	g := &Sentinels{}
	defer func() {
		if err != nil {
			g.Close()
		}
	}()
	if g.Master, err = StartRedis(PersistNone); err != nil {
		return nil, err
	}
	if g.Replica, err = StartRedis(PersistNone, "--replicaof", "127.0.0.1", strconv.Itoa(g.Master.Port())); err != nil {
		return nil, err
	}
	if err := waitFor(30*time.Second, func() error { return replicaInSync(g.Replica.Addr) }); err != nil {
		return nil, fmt.Errorf("replica: %w", err)
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, err
	}
	for range 3 {
		s, err := startSentinel(bin, g.Master.Port())
		if err != nil {
			return nil, err
		}
		g.Sentinels = append(g.Sentinels, s)
		g.Addrs = append(g.Addrs, fmt.Sprintf("127.0.0.1:%d", s.Port()))
	}
	g.URL = "redis://" + g.Addrs[0] + "/0?master_name=" + MasterName + "&addr=" + g.Addrs[1] + "&addr=" + g.Addrs[2]
	for _, addr := range g.Addrs {
		if err := waitFor(60*time.Second, func() error { return sentinelReady(addr) }); err != nil {
			return nil, fmt.Errorf("sentinel %s: %w", addr, err)
		}
	}
	return g, nil
}

// startSentinel starts one Sentinel monitoring the master on masterPort.
func startSentinel(bin string, masterPort int) (*Server, error) {
	dir, port, err := dirAndPort("idemq-sentinel-")
	if err != nil {
		return nil, err
	}
	conf := filepath.Join(dir, "sentinel.conf")
	text := fmt.Sprintf(`port %d
bind 127.0.0.1
dir %s
sentinel monitor %s 127.0.0.1 %d 2
sentinel down-after-milliseconds %s 1000
sentinel failover-timeout %s 4000
sentinel parallel-syncs %s 1
`, port, dir, MasterName, masterPort, MasterName, MasterName, MasterName)
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	s := &Server{port: port, dir: dir, stopSignal: syscall.SIGTERM}
	s.p = &process{name: "private sentinel", dir: dir, log: filepath.Join(dir, "sentinel.log"), argv: []string{bin, conf, "--sentinel"}}
	s.ready = pinged(fmt.Sprintf("127.0.0.1:%d", port))
	return s, s.startOrClose()
}

// Close stops every server of the group and removes their directories.
func (g *Sentinels) Close() {
	for _, s := range g.Sentinels {
		s.Close()
	}
	for _, r := range []*Redis{g.Master, g.Replica} {
		if r != nil {
			r.Close()
		}
	}
}

// CurrentMaster is the address the Sentinels name as the master now.
func (g *Sentinels) CurrentMaster(ctx context.Context) (string, error) {
	s := redis.NewSentinelClient(&redis.Options{Addr: g.Addrs[0], DialTimeout: time.Second})
	defer s.Close()
	addr, err := s.GetMasterAddrByName(ctx, MasterName).Result()
	if err != nil {
		return "", err
	}
	return addr[0] + ":" + addr[1], nil
}

// replicaInSync reports nil once the replica at addr has its link to the master up.
func replicaInSync(addr string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second})
	defer c.Close()
	info, err := c.Info(ctx, "replication").Result()
	if err != nil {
		return err
	}
	if !strings.Contains(info, "master_link_status:up") {
		return errors.New("link to the master not up yet")
	}
	return nil
}

// sentinelReady reports nil once the Sentinel at addr knows the replica and the two
// other Sentinels, which a failover needs.
func sentinelReady(addr string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	s := redis.NewSentinelClient(&redis.Options{Addr: addr, DialTimeout: time.Second})
	defer s.Close()
	replicas, err := s.Replicas(ctx, MasterName).Result()
	if err != nil {
		return err
	}
	sentinels, err := s.Sentinels(ctx, MasterName).Result()
	if err != nil {
		return err
	}
	if len(replicas) < 1 || len(sentinels) < 2 {
		return fmt.Errorf("knows %d replicas and %d other sentinels", len(replicas), len(sentinels))
	}
	return nil
}

// Cluster is a Redis Cluster of private masters (no replicas) on free loopback ports.
type Cluster struct {
	Nodes []*Redis
	// URL names the cluster in go-redis's cluster form (redis://n1?addr=n2&addr=n3).
	URL string
}

// StartCluster starts n cluster-enabled servers, joins them with `redis-cli --cluster
// create` (every slot assigned) and waits until each reports cluster_state:ok.
func StartCluster(n int) (_ *Cluster, err error) {
	c := &Cluster{}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		return nil, errors.New("redis-cli not found on PATH (apt-get install -y redis-tools)")
	}
	args := []string{"--cluster", "create"}
	for range n {
		r, err := StartRedis(PersistNone, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
		if err != nil {
			return nil, err
		}
		c.Nodes = append(c.Nodes, r)
		args = append(args, r.Addr)
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("redis-cli --cluster create: %w\n%s", err, out)
	}
	c.URL = "redis://" + c.Nodes[0].Addr
	for i, r := range c.Nodes[1:] {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		c.URL += sep + "addr=" + r.Addr
	}
	for _, r := range c.Nodes {
		if err := waitFor(60*time.Second, func() error { return clusterOK(r.Addr) }); err != nil {
			return nil, fmt.Errorf("cluster node %s: %w", r.Addr, err)
		}
	}
	return c, nil
}

// Close stops every node and removes their directories.
func (c *Cluster) Close() {
	for _, r := range c.Nodes {
		r.Close()
	}
}

func clusterOK(addr string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second})
	defer c.Close()
	info, err := c.ClusterInfo(ctx).Result()
	if err != nil {
		return err
	}
	if !strings.Contains(info, "cluster_state:ok") {
		return errors.New("cluster_state not ok yet")
	}
	return nil
}
