//go:build tools

// The commands tools/build.sh builds from this module: importing them keeps `go mod tidy` from
// dropping what they need.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
