// Command etcd is etcd's server (go.etcd.io/etcd/server/v3/etcdmain), as its release binary runs it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
