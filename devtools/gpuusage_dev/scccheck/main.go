// scc-check runs OpenShift's own SecurityContextConstraints matching on one pod, with no
// OpenShift cluster: the code the openshift-apiserver's admission runs
// (github.com/openshift/apiserver-library-go's sccdefaults and sccmatching), so a test can ask
// whether an SCC admits a pod and what security context it gives it.
//
// It reads one JSON object on stdin:
//
//	{"namespace": <v1 Namespace, with OpenShift's openshift.io/sa.scc.* annotations>,
//	 "scc": <security.openshift.io/v1 SecurityContextConstraints>,
//	 "pod": <v1 Pod>}
//
// and writes {"errors": [...], "pod": <the pod as the SCC would admit it>}: the SCC's defaults
// are set as the openshift-apiserver sets them on an SCC it stores, the pod's as the apiserver
// defaults a pod it admits; errors empty means the SCC admits the pod. A bad input exits 2.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	securityv1 "github.com/openshift/api/security/v1"
	"github.com/openshift/apiserver-library-go/pkg/securitycontextconstraints/sccdefaults"
	"github.com/openshift/apiserver-library-go/pkg/securitycontextconstraints/sccmatching"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"
	api "k8s.io/kubernetes/pkg/apis/core"
	apiv1 "k8s.io/kubernetes/pkg/apis/core/v1"
)

type input struct {
	Namespace corev1.Namespace                     `json:"namespace"`
	SCC       securityv1.SecurityContextConstraints `json:"scc"`
	Pod       corev1.Pod                           `json:"pod"`
}

type output struct {
	Errors []string   `json:"errors"`
	Pod    corev1.Pod `json:"pod"`
}

func fail(what string, err error) {
	fmt.Fprintf(os.Stderr, "scc-check: %s: %v\n", what, err)
	os.Exit(2)
}

func main() {
	var in input
	decoder := json.NewDecoder(os.Stdin)
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(&in); err != nil {
		fail("reading the input", err)
	}
	sccdefaults.SetDefaults_SCC(&in.SCC)
	provider, err := sccmatching.CreateProviderFromConstraint(&in.Namespace, &in.SCC)
	if err != nil {
		fail("the SCC", err)
	}
	apiv1.SetObjectDefaults_Pod(&in.Pod)
	var pod api.Pod
	if err := apiv1.Convert_v1_Pod_To_core_Pod(&in.Pod, &pod, nil); err != nil {
		fail("the pod", err)
	}
	errs := sccmatching.AssignSecurityContext(provider, &pod, field.NewPath("provider "+in.SCC.Name))
	out := output{Errors: []string{}}
	for _, e := range errs {
		out.Errors = append(out.Errors, e.Error())
	}
	if err := apiv1.Convert_core_Pod_To_v1_Pod(&pod, &out.Pod, nil); err != nil {
		fail("the admitted pod", err)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail("writing the answer", err)
	}
}
